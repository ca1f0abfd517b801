"""The policy generating on its own training weights: where the weights are while it does (layouts)."""
