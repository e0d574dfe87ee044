"""Turn autoregressive checkpoints into ReFusion models and fine-tune them under the hybrid objective."""
