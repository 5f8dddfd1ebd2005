// dockerfile-check: BuildKit's Dockerfile frontend (the one `docker build` runs) over Containerfiles,
// without a daemon or a registry. For each file: the lint rules of `docker build --check`, then the
// conversion of every instruction to BuildKit's LLB, marshalled. A podman-only instruction or flag, a
// parse error or a lint warning fails it. Usage: dockerfile-check [ARG=VALUE...] FILE...
// (build args apply to the files after them). Prints one line per file; exit 1 on any finding.
package main

import (
	"context"
	"fmt"
	"os"
	"strings"

	"github.com/moby/buildkit/client/llb"
	"github.com/moby/buildkit/client/llb/sourceresolver"
	"github.com/moby/buildkit/frontend/dockerfile/dockerfile2llb"
	"github.com/moby/buildkit/frontend/dockerui"
	digest "github.com/opencontainers/go-digest"
)

// noRegistry answers every FROM with a minimal image config, since no registry is reachable here: what
// is checked is the Containerfile, not the base image's contents. It records the references it was asked.
type noRegistry struct{ refs []string }

func (n *noRegistry) ResolveImageConfig(_ context.Context, ref string, _ sourceresolver.Opt) (string, digest.Digest, []byte, error) {
	n.refs = append(n.refs, ref)
	cfg := []byte(`{"architecture":"amd64","os":"linux","config":{"Env":["PATH=/usr/local/bin:/usr/bin:/bin"]},` +
		`"rootfs":{"type":"layers","diff_ids":[]}}`)
	return ref, digest.FromBytes(cfg), cfg, nil
}

func convertOpt(ctx context.Context, name string, dt []byte, args map[string]string) (dockerfile2llb.ConvertOpt, *noRegistry) {
	src := llb.Local("dockerfile")
	buildContext := llb.Local("context") // COPY's sources, as docker build sends its context
	smap := llb.NewSourceMap(&src, name, "Dockerfile", dt)
	def, err := src.Marshal(ctx)
	if err != nil {
		panic(err)
	}
	smap.Definition = def
	resolver := &noRegistry{}
	return dockerfile2llb.ConvertOpt{Config: dockerui.Config{BuildArgs: args}, SourceMap: smap,
		MainContext: &buildContext, MetaResolver: resolver}, resolver
}

// check returns the findings for one file and, when there are none, a summary of what BuildKit made of it.
func check(ctx context.Context, name string, args map[string]string) ([]string, string) {
	dt, err := os.ReadFile(name)
	if err != nil {
		return []string{err.Error()}, ""
	}
	var findings []string
	opt, _ := convertOpt(ctx, name, dt, args)
	lint, err := dockerfile2llb.DockerfileLint(ctx, dt, opt)
	if err != nil {
		return []string{"lint: " + err.Error()}, ""
	}
	if lint.Error != nil {
		findings = append(findings, "error: "+lint.Error.Message)
	}
	for _, w := range lint.Warnings {
		findings = append(findings, fmt.Sprintf("lint %s: %s (%s)", w.RuleName, w.Detail, w.URL))
	}
	opt, resolver := convertOpt(ctx, name, dt, args)
	st, img, _, _, err := dockerfile2llb.Dockerfile2LLB(ctx, dt, opt)
	if err != nil {
		return append(findings, "convert: "+err.Error()), ""
	}
	def, err := st.Marshal(ctx)
	if err != nil {
		return append(findings, "marshal: "+err.Error()), ""
	}
	return findings, fmt.Sprintf("0 lint warnings, %d LLB ops, FROM %s, USER %s, ENTRYPOINT %q, CMD %q",
		len(def.Def), strings.Join(resolver.refs, ","), img.Config.User, img.Config.Entrypoint, img.Config.Cmd)
}

func main() {
	ctx := context.Background()
	args := map[string]string{}
	failed := false
	for _, a := range os.Args[1:] {
		if k, v, ok := strings.Cut(a, "="); ok && !strings.Contains(k, "/") {
			args[k] = v
			continue
		}
		findings, summary := check(ctx, a, args)
		for _, f := range findings {
			fmt.Printf("%s: %s\n", a, f)
		}
		if len(findings) > 0 {
			failed = true
		} else {
			fmt.Printf("%s: ok: %s\n", a, summary)
		}
	}
	if failed {
		os.Exit(1)
	}
}
