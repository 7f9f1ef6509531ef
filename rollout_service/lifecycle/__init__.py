"""The vocabulary of a sample's life: groups, requests, samples and their
per-token policy versions. Below the core and the policies, so that both
speak it (the core drives it; placement, rebalancing and carry-over read it)."""
