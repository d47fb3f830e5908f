"""Where the strategies meet: the composition layer builds the concept objects for each part of the mesh and hands them what they need; the checks of a mesh's combinations."""
