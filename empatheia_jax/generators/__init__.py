"""Output generators (speech and face) behind one interface and registry, and the sample's own speech
synthesizer."""
