"""rounds() freezes what the process imported before its first round (a full garbage collection at the
end of a round then skips it) and nothing of a round's own: a round's model, built by ``prepare``
before the round's process group exists, must stay collectable."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from elastic_rm.etcd.server import free_port

WORKER = textwrap.dedent(
    """
    import gc, weakref
    import torch.distributed as dist
    from elastic_rm.train.report import StepReporter
    from elastic_rm.train.rounds import rounds

    class Node:
        pass

    before = Node(); before.me = before  # a cycle made before the first round: frozen with the imports
    assert gc.get_freeze_count() == 0
    refs = []
    order = []

    def prepare():
        order.append(("prepare", dist.is_initialized()))
        model = Node(); model.me = model  # a round's model in a cycle, as a DMP and its groups are
        refs.append(weakref.ref(model))
        return model

    for rnd in rounds(StepReporter(agent_dir=None), prepare=prepare):
        assert gc.get_freeze_count() > 0, "rounds() froze nothing"
        assert "group" in rnd.times and rnd.times["prepared"] <= rnd.times["group"], rnd.times
        model = rnd.take_prepared()
        assert model is not None and rnd.take_prepared() is None  # handed over once
        del model
    assert order == [("prepare", False)], order  # prepared once, before the process group existed
    gc.collect()
    assert refs[0]() is None, "a round's object was frozen: it would never be collected"
    assert any(o is before for o in gc.get_objects()) is False  # frozen objects are out of gc's lists
    dist.destroy_process_group()
    print("ok")
    """
)


def test_rounds_prepares_before_the_group_and_freezes_only_the_imports():
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "RANK": "0",
        "WORLD_SIZE": "1",
    }
    env.pop("ELASTIC_RM_AGENT_DIR", None)
    out = subprocess.run(
        [sys.executable, "-c", WORKER], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")
