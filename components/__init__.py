"""KFP components (``kfrl.components``): one thin wrapper per stage in ``components/stages.py``."""
