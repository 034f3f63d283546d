"""The reference online trainer: a DLRM-style model sharded with DMP, publishing segments."""
