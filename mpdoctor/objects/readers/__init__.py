"""Readers: one live torch object (a module's tensors, an optimizer, a scaler, a config tree, the device)
read into its plain facts, through ``type``'s own descriptors, never running user code."""
