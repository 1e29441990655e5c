{
  lib,
  stdenv,
  rustPlatform,
  pkg-config,
  protobuf,
  openssl,
  installShellFiles,
}:

rustPlatform.buildRustPackage {
  pname = "ccci-run";
  version = (lib.importTOML ../Cargo.toml).package.version;
  # Only what the build reads: a local target/ (hundreds of MB) never reaches the store.
  src = lib.fileset.toSource {
    root = ../.;
    fileset = lib.fileset.unions [
      ../Cargo.toml
      ../Cargo.lock
      ../src
      ../benches
      ../tests
    ];
  };
  cargoLock.lockFile = ../Cargo.lock;

  # The system's OpenSSL and libgit2 build; `--features vendored` is the self-contained binary
  # for hosts without Nix. The etcd backend is in: a fleet of runners shares its locks there.
  buildFeatures = [ "etcd" ];
  nativeBuildInputs = [
    pkg-config
    protobuf
    installShellFiles
  ];
  buildInputs = [ openssl ];

  # Completions and every man page (the units' Documentation=man:ccci-run(1) resolves).
  postInstall = lib.optionalString (stdenv.buildPlatform.canExecute stdenv.hostPlatform) ''
    installShellCompletion --cmd ccci-run \
      --bash <($out/bin/ccci-run completions bash) \
      --zsh <($out/bin/ccci-run completions zsh) \
      --fish <($out/bin/ccci-run completions fish)
    mkdir -p man
    $out/bin/ccci-run man --dir man
    installManPage man/*.1
  '';

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
