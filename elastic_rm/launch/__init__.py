"""`erm launch`: start and release `ermrun` agents on bare-metal hosts over ssh (docs/launch.md)."""
