"""Text -> token samples -> per-layer activation statistics, and the layer-by-layer runner."""
