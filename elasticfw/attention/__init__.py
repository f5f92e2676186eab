"""Attention core: sequence coordinates, block layouts, the mode and executor contracts."""
