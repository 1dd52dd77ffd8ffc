"""Training drafters for a target by self-distillation (``specdecode train ...``)."""
