"""The GPU client's own process: it joins a room, offers its slots, receives jobs and starts
their rank processes (``launcher``); its work dir, identity, datasets and reachability."""
