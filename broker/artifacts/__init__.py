"""Code artifacts on a broker's disk: the content-addressed store and the upload checks."""
