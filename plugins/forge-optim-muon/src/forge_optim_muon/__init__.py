"""forge-optim-muon: the Muon optimizer for Forge."""
