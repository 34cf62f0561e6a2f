"""Making a plan: the sensitivity profile (slow, resumable) and the allocation methods that turn a
budget into a plan."""
