"""Where models and text come from: model loading (hub id, folder, pruned folder, GGUF, built-in tiny), the fetched
real offline world, the synthetic world, what a data name means, and the calibration draw. Imports no other stage."""
