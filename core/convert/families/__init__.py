"""One module per architecture family, each saying only how it differs from corral.convert.family."""
