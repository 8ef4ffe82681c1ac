// Package internal holds the project's C boundary: one package per loaded library or
// compiled kernel set. This file's test enforces that boundary for the whole module.
package internal

import (
	"go/parser"
	"go/token"
	"io/fs"
	"path/filepath"
	"strings"
	"testing"
)

// TestCgoOnlyUnderInternal: `import "C"` is allowed only in packages under internal/, so
// everything above the boundary builds, tests and reasons in plain Go.
func TestCgoOnlyUnderInternal(t *testing.T) {
	root := ".."
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			// what the go tool itself ignores (".git", ".venv", device carry folders, "_obj"),
			// and trees of other languages
			name := d.Name()
			if path != root && (strings.HasPrefix(name, ".") || strings.HasPrefix(name, "_") || name == "python" || name == "node_modules") {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(path, ".go") {
			return nil
		}
		f, err := parser.ParseFile(token.NewFileSet(), path, nil, parser.ImportsOnly)
		if err != nil {
			return err
		}
		for _, imp := range f.Imports {
			rel, _ := filepath.Rel(root, path)
			if imp.Path.Value == `"C"` && !strings.HasPrefix(rel, "internal"+string(filepath.Separator)) {
				t.Errorf("%s imports \"C\": cgo belongs under internal/", rel)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}
