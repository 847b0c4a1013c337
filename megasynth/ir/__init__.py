"""The schedule IR: the format (`schedule`), the model configuration (`model`), the op catalogue (`catalogue`) and a
schedule resolved against them (`program`). Imports neither torch nor triton."""
