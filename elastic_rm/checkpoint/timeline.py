"""Which checkpoints belong to the run's history, and which a restore abandoned.

A restore that loads a step older than the newest one saved (the newer ones were corrupt, partial or
lost) lets training go on from it and save the next step numbers again. The abandoned steps must never
be restored, nor mixed with the new ones of the same number: yet a node that no restore source reached
then (cut off, or its agent down, its memory intact) still holds them, in its memory and in the
replicas it keeps, and brings them back when it is reachable again. So every manifest names its
timeline:

    "timeline": {"id": 2, "from": [[0, 3], [1, 7]]}

``id`` numbers the timelines of the run (a restore that abandons steps starts ``id`` + 1), and ``from``
is its history: timeline 0 up to step 3, then timeline 1 up to step 7, then this one. A manifest
without the field (older versions, a fresh run) is on timeline 0 from nothing.

At a restore the ranks agree on the newest timeline that any source the restore may read holds (the
highest id, read from manifests that pass their checksum); a step is then restorable only when it lies
on that timeline's history. Limits: a timeline shows itself by its saves, so one whose round failed
before its first save leaves no trace, and the history it abandoned counts as current again (every
member dropped those steps at its start; only a node no source reached can still hold them). And ids
are unique only among the timelines a restore can see: a fork made while every holder of the newest
timeline was out of reach takes the same id; when both are reachable again, a restore may take the
steps of either, but never mixes them (a step's files are read only with its own manifest, and a delta
only on the steps its manifest names by digest).

Pure: the manifest checks use it, and retention.py reads the timelines a directory holds.
"""

from __future__ import annotations

from typing import Any

# (id, ((id, last step), ...)): hashable, ordered by id, then by history (ties are deterministic)
Key = tuple[int, tuple[tuple[int, int], ...]]
ORIGIN: Key = (0, ())


def check_field(value: Any) -> str | None:
    """Why a manifest's ``timeline`` value is malformed, or None when it is sound (or absent)."""
    if value is None:
        return None
    if not isinstance(value, dict) or not {"id", "from"} <= set(value):
        return "'timeline' must be a JSON object with 'id' and 'from'"
    tid, history = value["id"], value["from"]

    def is_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    if not is_int(tid) or not isinstance(history, list):
        return "'timeline' needs an integer 'id' (>= 0) and a list 'from'"
    ids = []
    for pair in history:
        if not isinstance(pair, list) or len(pair) != 2 or not all(is_int(v) for v in pair):
            return "'timeline.from' must hold [timeline id, step] pairs of integers >= 0"
        ids.append(pair[0])
    if ids != sorted(set(ids)) or any(i >= tid for i in ids):
        return "'timeline.from' must name earlier timelines, oldest first"
    return None


def key_of(manifest: dict[str, Any]) -> Key:
    """The timeline of a manifest whose fields passed check_field (ORIGIN when it names none)."""
    value = manifest.get("timeline")
    if value is None:
        return ORIGIN
    return int(value["id"]), tuple((int(t), int(s)) for t, s in value["from"])


def as_field(key: Key) -> dict[str, Any]:
    """The manifest field of a timeline (JSON: lists, not tuples)."""
    return {"id": key[0], "from": [list(pair) for pair in key[1]]}


def from_json(value: Any) -> Key | None:
    """A key sent between ranks as JSON (as_field's form), None for None or a malformed one."""
    if value is None or check_field(value) is not None:
        return None
    return key_of({"timeline": value})


def is_live(current: Key, manifest: dict[str, Any]) -> bool:
    """Is this (sound) manifest's step on the history of the `current` timeline: of that timeline, or
    of one it grew from, no later than the step it grew from?"""
    key, step = key_of(manifest), int(manifest["step"])
    if key == current:
        return True
    history = current[1]
    for i, (tid, last) in enumerate(history):
        if tid == key[0]:
            return step <= last and key[1] == history[:i]
    return False


def forked(current: Key, restored: dict[str, Any]) -> Key:
    """The timeline the saves after a restore of `restored` (live on `current`) carry when that restore
    abandoned newer steps: a new id, and the restored timeline's history up to the restored step."""
    key = key_of(restored)
    return current[0] + 1, (*key[1], (key[0], int(restored["step"])))
