"""What a GRPO rollout may call: the recipe's tools and environments (user code, found before any weight is read),
run under a time limit, and the model's calls read back out of its replies in its family's format."""
