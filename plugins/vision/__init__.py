"""Built-in vision encoders: the image side of a model, from its projector (`mmproj`) file."""
