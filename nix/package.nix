{
  lib,
  rustPlatform,
  pkg-config,
  openssl,
}:

rustPlatform.buildRustPackage {
  pname = "ccci-run";
  version = (lib.importTOML ../Cargo.toml).package.version;
  src = lib.cleanSource ../.;
  cargoLock.lockFile = ../Cargo.lock;

  nativeBuildInputs = [ pkg-config ];
  buildInputs = [ openssl ];

  # The suite drives real processes, flocks, signals and a Docker engine: it runs in CI, not in
  # the sandbox of a Nix build.
  doCheck = false;

  meta = {
    description = "Daemonless run supervisor for recipe CI on a Co-op Cloud host";
    license = lib.licenses.agpl3Plus;
    mainProgram = "ccci-run";
    platforms = lib.platforms.linux;
  };
}
