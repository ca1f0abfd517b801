"""The label conventions the data (which writes labels) and the model's loss (which reads them) share."""

IGNORE_INDEX = -100  # the label of a token that is not a target (the convention of torch and transformers)
