"""What a layout costs at any world size, before anyone rents a GPU (docs/plan.md).

The real model and the real ``moetrain.parallel.parallelize`` run on the meta device under a
fake process group of the planned world size, one distinct rank at a time; the model state
is read off the tensors that produced, activations and traffic come from the same layout's
figures, and a step time from a table of hardware constants.
"""
