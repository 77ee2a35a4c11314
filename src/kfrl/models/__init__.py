"""Model building blocks: the builtin tiny model and HF directory I/O."""
