"""Schedule search: choose knobs by simulation (`--schedule auto` and the advice of `plan`)."""
