"""FX graph passes: export, MLA matching, cached-attention insertion, piecewise splitting."""
