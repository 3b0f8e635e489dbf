"""The Trio runtime: one actor per sequence feeding one batching actor per loaded model."""
