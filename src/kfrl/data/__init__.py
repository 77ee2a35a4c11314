"""Datasets in veRL's RL row schema."""
