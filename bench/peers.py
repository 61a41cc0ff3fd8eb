"""The peers the benches compare with, imported lazily (the ``bench`` extra installs them)."""


def tokamax():
  """The ``tokamax`` module, with absl's flags marked parsed (else it parses pytest's argv)."""
  import tokamax as module
  from absl import flags

  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
  return module
