"""Data: nuScenes loading, BEV targets and the synthetic dataset generator."""
