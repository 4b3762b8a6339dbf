"""A plugin with a misspelt hook name."""

from graphmode import hookimpl


@hookimpl
def graphmode_fil_buffers(meta, inputs, batch_size, bucket):
    return True
