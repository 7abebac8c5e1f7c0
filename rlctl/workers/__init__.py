"""Workers that hold models. In-process today (`rlctl.workers.local`); Ray actor groups with
the same interface come with distributed training."""
