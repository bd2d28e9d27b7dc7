"""``policy="autodist"``: the candidates it searches (:mod:`.space`) and what each costs a rank (:mod:`.graph_costs`);
the search itself runs where the graph is captured (:mod:`dynshard.backend.autodist`)."""
