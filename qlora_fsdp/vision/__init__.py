"""The image side inside the decoder's forward: image features placed at the image tokens of a row (or a split row's
part), their positions (Qwen-VL's grids) and the cross-attention inputs of the families that read images that way."""
