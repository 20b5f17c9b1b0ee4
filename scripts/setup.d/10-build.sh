# librdkafka is built from source by rdkafka-sys: make, a C/C++ compiler,
# zlib, and OpenSSL for TLS and SASL SCRAM/OAUTHBEARER (all four are on a new
# machine of this kind). libcurl, for OIDC, is built from the source bundled
# with curl-sys (feature curl-static), so no libcurl development package is
# needed. pkg-config helps the C builds find their libraries.
apt_install make g++ pkg-config zlib1g-dev libssl-dev
