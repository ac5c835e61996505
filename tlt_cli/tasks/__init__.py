"""Built-in tasks (prompts with exactly verifiable answers) and their rewards."""
