"""The EAGLE-style drafter: model, losses, offline warm-up, and the trainer a plugin runs to train it online."""
