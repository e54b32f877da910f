"""elastic.horovod: Horovod's API over elastic-run, so that a Horovod elastic script moves by
changing its import: ``import elastic.horovod.torch as hvd`` in place of
``import horovod.torch as hvd``. See docs/horovod.md for what differs."""
