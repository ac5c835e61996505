"""The EAGLE-style drafter: model, losses, offline warm-up, and the sidecar that trains it online on idle workers."""
