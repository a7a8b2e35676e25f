"""Op-regions and where each runs: timing at start, the tuning profile, dynamic re-balancing and
backpressure degrade.
"""
