"""The jitted step makers (`make_train_step` and friends), the loss's pieces, remat and the program rewrites they apply."""
