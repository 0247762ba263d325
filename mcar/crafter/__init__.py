"""Crafter, the first world of mcar: its simulator (the only code that reads Crafter's internals), its episodes
and data module, the fresh starts of post-training, its textures, its reward terms and its world tests (memory,
collisions by obstacle, creatures). A wing: it imports the framework; the framework never imports it, and finds
it by the `_target_`s of the Crafter configs (mcar/conf/data/crafter*.yaml, posttrain.yaml, vq_train.yaml).
"""
