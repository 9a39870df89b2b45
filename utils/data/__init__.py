"""Everything about data: the data YAML, label cache, image reading, augmentation, samplers and loaders."""
