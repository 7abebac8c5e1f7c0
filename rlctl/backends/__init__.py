"""Model-holding code behind small interfaces (`base.RolloutEngine`): the HF backend today."""
