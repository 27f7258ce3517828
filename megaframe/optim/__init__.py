"""One optimizer seam for every engine: the optimizer and its parameter groups are built here from
`optim` (build.py), each optimizer names its per-parameter state (table.py), which the layout-free
checkpoint and the memory accounting read by name. AdamW is torch's; Muon is muon.py."""
