"""Training through the export (`export.target`): llama.cpp's quantizers in torch, the type each tensor gets, and
the straight-through forward that reads the weight the GGUF will hold."""
