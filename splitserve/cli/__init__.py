"""The driver: the `splitserve` command (`main`), `serve`'s bring-up and shut-down (`serve`), its
one-line errors (`errors`), and the Ray Serve app with its builder (`app`)."""
