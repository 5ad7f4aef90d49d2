"""What goes in and what comes out: images and models in, explanations, pixels and figures out.

    inputs.py        path / PIL / ndarray / tensor → the model's batch and the display image
    blur.py          Gaussian blur of images (blurred baselines and perturbations)
    loaded_model.py  LoadedModel: a model with its preprocessing and class names
    explanation.py   Explanation: maps, targets, scores and images of one call; show, save, index
    render.py        colour maps, overlays, tiles and captions (pixels); an explanation's own figure
    figures.py       paper figures: grids of explanations with titles and colour bars

Nothing here imports a method: drawing works on any maps.
"""
