"""Tests against the training stacks' own code (skipped when a stack is not installed)."""
