"""The stepper: one precision step in order (scale, unscale, check, masters, clip, step or skip, update)."""
