"""The EAGLE-style drafter: model, losses and training."""
