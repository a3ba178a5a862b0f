"""Example corekv plugins, installed through the ``corekv`` entry-point group.

* :mod:`corekv_example_plugins.compressed_host`: tier ``compressed_host`` (zstd in CPU memory);
* :mod:`corekv_example_plugins.compressed_files`: tier ``compressed_files`` (zstd files in a
  folder, with an admin view for ``corekv store``);
* :mod:`corekv_example_plugins.lfu_blocks`: backend ``lfu_blocks`` (hash blocks, LFU eviction);
* :mod:`corekv_example_plugins.fifo`: eviction policy ``fifo`` (oldest stored first), for every
  backend and tier that takes an ``eviction`` option.

Importing this package imports none of them: corekv imports each entry point's module itself.
"""
